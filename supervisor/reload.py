"""`modelpool reload` and SIGHUP: the config read again and its models applied to the
running daemon, without a restart and without losing work.

- A model the config adds is known at once and loads on first use, as at start.
- A removed model takes no new requests (UNKNOWN_MODEL); what it had queued or running
  is served, then its workers stop and it is gone (`status`: `removing` until then).
- A model whose files, loader or options change (what it loads) keeps serving on its
  workers, which are then replaced one at a time (the scaling policy's replacements,
  as when an ONNX export becomes ready); new workers load it as now configured.
- Any other change of a model (aliases, default, limits, estimates) applies at once;
  when it changes what its workers keep from their start (threads, the batch of a
  forward pass), they are replaced one at a time as well.
- A change of [access] applies at once: to new connections, to the requests that come
  next on open ones, and a connection whose user it no longer admits is closed. So do
  [defaults] and [images] (the workers of models taking images, which enforce its
  limits, are replaced one at a time), [pool] (budgets, worker counts, batching, queue
  bounds and timeouts from now on; workers whose threads, batch or heartbeat it changes
  are replaced one at a time), [jobs] (its bounds, retention and timeout, from the next
  job on), [daemon]'s client limits, frame and connection caps (for the clients that
  connect next), log level, `realtime` and `socket_group` (the socket's group and mode,
  for connections from then on), [cluster]'s routing of direct
  requests, its bound on stranded jobs and its lease (for the claims and renewals from
  then on), and [http]: the front door's keys
  (api_key_file read again) and request limits at once; a new address or connection
  settings by a new front door taking over from the old (supervisor/http_front.py).
- A change of capability, or of what a model loads while a weights holder shares its
  weights, and changes of other sections, wait for a restart: the reload says which.

`plan_reload` is pure: what the running registry and the new config differ in.
`apply_reload` makes the pool so; the server reads the file and, in a cluster, has the
new models' files identified before it applies (supervisor/server.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from modelpool.protocol.kinds import KINDS
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.config import Config, PoolConfig
from modelpool.supervisor.models import ModelSettings, ModelState

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Pool

# What a worker loads: a change of any of these needs new workers.
LOAD_FIELDS = ("path", "package", "repo", "revision", "subdir", "loader", "options",
               "allow_pickle", "trust_remote_code", "device", "weights_holder",
               "execution", "max_active_sequences")
REPLACED_BECAUSE = "its model's config changed (reload)"
IMAGES_CHANGED = "the [images] limits changed (reload)"
STARTED_WITH_CHANGED = "the threads, batch or heartbeat its workers started with changed (reload)"
LIVE_SECTIONS = ("access", "defaults", "images", "pool", "jobs", "http")  # applied whole
IMAGE_CAPABILITIES = frozenset(capability for kind in KINDS if kind.with_images is not None
                               for capability in kind.served_by)
# The fields that wait for a restart in sections whose other fields apply at once
# ([daemon]'s client limits, caps, log level, realtime and socket group, [cluster]'s
# routing, stranded jobs' bound and lease): where the daemon listens, what it connects
# to, what it set up at start.
AT_START = {
    "daemon": ("socket", "log_format", "event_loop", "idle_cgroup"),
    "cluster": ("postgres", "node_name"),
}


@dataclass(frozen=True)
class ReloadPlan:
    specs: tuple[ModelSpec, ...]  # the registry after the reload, in the config's order
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()  # what it loads changed: its workers are replaced
    retuned: tuple[str, ...] = ()  # other settings changed: applied as they are
    kept: tuple[tuple[str, str], ...] = ()  # (key, why) changes that wait for a restart
    restart_for: tuple[str, ...] = ()  # config sections whose changes wait for a restart
    applied: tuple[str, ...] = ()  # changed sections applied at once

    def loading(self) -> list[ModelSpec]:
        """The models whose workers will load something new."""
        changed = {*self.added, *self.replaced}
        return [spec for spec in self.specs if spec.key in changed]

    def summary(self) -> str:
        parts = [f"{what}: {', '.join(keys)}" for what, keys in (
            ("added", self.added), ("removed (serving what it has, then stopping)",
                                    self.removed),
            ("replaced (its workers, one at a time)", self.replaced),
            ("updated", self.retuned)) if keys]
        if self.applied:
            parts.append(f"{', '.join(self.applied)} applied")
        parts += [f"{key} not changed: {why}" for key, why in self.kept]
        if self.restart_for:
            parts.append(f"changes of {', '.join(self.restart_for)} apply at the next start")
        return "; ".join(parts) if parts else "no change"


def plan_reload(running: Mapping[str, ModelSpec], new: Mapping[str, ModelSpec],
                running_config: Config, new_config: Config,
                shared: frozenset[str] = frozenset(),
                draining: Mapping[str, ModelSpec] | None = None,
                http: bool = False) -> ReloadPlan:
    """What to change, from the running registry's specs to the new config's; `shared`
    are the models whose weights a live holder process shares, `draining` those an
    earlier reload removed that still serve what they had; `http`: the HTTP front
    door changes (its keys, which api_key_file holds too, its limits or a new one)."""
    added, replaced, retuned, kept = [], [], [], []
    specs = []
    for key, spec in new.items():
        old = running.get(key)
        was = old or (draining or {}).get(key)
        why = _kept_because(was, spec, key in shared) if was is not None else None
        if why:
            kept.append((key, why))
            if old is not None:
                specs.append(old)
            continue
        specs.append(spec)
        if old is None:
            added.append(key)
        elif any(getattr(old, f) != getattr(spec, f) for f in LOAD_FIELDS):
            replaced.append(key)
        elif old != spec:
            retuned.append(key)
    removed = [key for key in running if key not in new]
    sections = [f"[{name}]" for name in Config.__struct_fields__
                if _waits_for_restart(name, running_config, new_config)]
    applied = [f"[{name}]" for name in LIVE_SECTIONS
               if getattr(running_config, name) != getattr(new_config, name)]
    applied += [f"[{name}]" for name in ("daemon", "cluster")
                if _applied_part(name, running_config, new_config)
                != getattr(running_config, name)]
    if http and "[http]" not in applied:  # its key file's keys changed
        applied.append("[http]")
    return ReloadPlan(tuple(specs), tuple(added), tuple(removed), tuple(replaced),
                      tuple(retuned), tuple(kept), tuple(sections), tuple(applied))


def applied_config(running: Config, new: Config) -> Config:
    """The running config with what a reload applies taken from new: the sections it
    applies whole, and the others' fields that do not wait for a restart."""
    return msgspec.structs.replace(
        running, **{name: getattr(new, name) for name in LIVE_SECTIONS},
        **{name: _applied_part(name, running, new) for name in AT_START})


def _applied_part(section: str, running: Config, new: Config) -> Any:
    """new's section, with the fields that wait for a restart as running has them."""
    return msgspec.structs.replace(getattr(new, section), **{
        f: getattr(getattr(running, section), f) for f in AT_START[section]})


def _waits_for_restart(section: str, running: Config, new: Config) -> bool:
    if section == "models" or section in LIVE_SECTIONS:
        return False
    if section in AT_START:
        return any(getattr(getattr(running, section), f) != getattr(getattr(new, section), f)
                   for f in AT_START[section])
    return bool(getattr(running, section) != getattr(new, section))


def _kept_because(old: ModelSpec, new: ModelSpec, shared: bool) -> str | None:
    if old.capability != new.capability:
        return (f"its capability changed ({old.capability} to {new.capability}): what it "
                "has queued could not run on the new model; a restart applies it (or a "
                "reload once a removed model has gone)")
    if shared and any(getattr(old, f) != getattr(new, f) for f in LOAD_FIELDS):
        return ("its workers map the weights a holder process shares; a restart applies "
                "the change of what it loads")
    return None


def apply_reload(pool: Pool, plan: ReloadPlan, new_config: Config) -> None:
    """Make the pool serve the plan's models under the reloaded config (applied_config),
    whose [defaults], [images], [pool] and [cluster] it reads from now on; the server
    hands [access], [daemon], [http] and [jobs] to their owners."""
    started = {key: _started_with(model.settings, pool.pool_config)
               for key, model in pool.models.items()}
    pool.config = applied_config(pool.config, new_config)
    if "[pool]" in plan.applied:
        pool.follow_pool_config()
        for model in pool.models.values():
            _retune(model, ModelSettings.of(model.spec, new_config.pool, pool.cpus))
    if "[images]" in plan.applied:  # its workers enforce the pixel limits and fetch URLs
        for model in pool.models.values():
            if model.spec.capability in IMAGE_CAPABILITIES:
                _outdate(model, IMAGES_CHANGED)
    pool.registry.update(list(plan.specs))
    for spec in plan.specs:
        if spec.key in plan.added and spec.key not in pool.models:
            pool.models[spec.key] = pool.model_state(spec)
        elif spec.key in (*plan.added, *plan.replaced, *plan.retuned):
            _adopt(pool, spec)
    for key, model in pool.models.items():
        if key in started and _started_with(model.settings, pool.pool_config) != started[key]:
            _outdate(model, STARTED_WITH_CHANGED)
    if pool.dispatcher.threads is not None:
        pool.dispatcher.threads.follow_models()
    for key in plan.removed:
        model = pool.models[key]
        model.retiring = True
        model.unpin()
        pool.exports.forget(model)
    pool.retire_removed()
    for model in list(pool.models.values()):
        pool.reconcile(model)


def _started_with(settings: ModelSettings, pool: PoolConfig) -> tuple[int, int, float]:
    """What a running worker keeps from its start (ModelState.worker_settings): when
    this changes, only new workers follow."""
    return settings.threads, settings.max_batch, pool.heartbeat_interval_s


def _outdate(model: ModelState, why: str) -> None:
    """Its workers are replaced one at a time (an earlier reason stays the one shown)."""
    for worker in model.live_workers():
        worker.outdated = worker.outdated or why


def _retune(model: ModelState, settings: ModelSettings) -> None:
    model.settings = settings
    if model.warm_target:  # `load N` asked for more than it may now have
        model.warm_target = min(model.warm_target, settings.max_workers)


def _adopt(pool: Pool, spec: ModelSpec) -> None:
    """A model that stays (or comes back while its removal drains) takes its new spec;
    workers loaded as before are replaced when what it loads changed."""
    model, fresh = pool.models[spec.key], pool.model_state(spec)
    old, model.retiring = model.spec, False
    model.spec, model.recommended = spec, fresh.recommended  # read again, as it may change
    _retune(model, fresh.settings)
    if any(getattr(old, f) != getattr(spec, f) for f in LOAD_FIELDS):
        model.device = fresh.device
        model.clear_failures()
        model.measured_weights_mb = model.measured_per_worker_mb = None
        pool.exports.forget(model)  # the server asks for the new files' export
        _outdate(model, REPLACED_BECAUSE)
