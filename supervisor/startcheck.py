"""The config's models checked before the daemon starts: a start that cannot serve what
it was given stops with one line naming the model and what is wrong, before anything
(socket, cgroup, forkserver) is made.

Refused: a [[models]] entry whose path does not exist or whose package is not installed,
and `options` keys its built-in loader does not read (a typo would otherwise be ignored
silently). A hub repo not in the Hugging Face cache is only warned about, naming the
`modelpool pull` to run: the daemon can serve everything else meanwhile, and requests
for that model are refused at once with the same words.
"""

from __future__ import annotations

from modelpool.registry.loaders import unknown_options
from modelpool.registry.sources import missing_files
from modelpool.supervisor.config import Config, ConfigError


def check_models(config: Config) -> list[str]:
    """Warnings for the log; ConfigError for the first entry that cannot be served."""
    warnings: list[str] = []
    for index, spec in enumerate(config.models):
        where = f"models[{index}] ({spec.key})"
        unknown, known = unknown_options(spec)
        if unknown:
            raise ConfigError(f"{where}: unknown option(s) {', '.join(map(repr, unknown))} "
                              f"for a {spec.capability} model (its loader takes "
                              f"{', '.join(known)})")
        missing = missing_files(spec)
        if missing is None:
            continue
        if not missing.downloadable:
            raise ConfigError(f"{where}: {missing.message}")
        warnings.append(missing.message)
    return warnings
