"""`modelpool pull MODEL` and `modelpool verify MODEL`: a model's files, without the daemon.

pull downloads a hub model into the Hugging Face cache with huggingface_hub (its own
progress bar, on a terminal only; an interrupted pull resumes where it stopped), then
verifies what it has; `--repair` first deletes every cached file that fails its check,
so that the download replaces it. verify checks the files a load would use: hub blobs
against the sha256 (or git sha1) they are named by, safetensors files for truncation.
MODEL is a key or alias of the catalogue and the config (`--config`, else
$MODELPOOL_CONFIG), or any hub repo as org/name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.cli_common import EXIT_MODEL_FAILURE, EXIT_OK, on_terminal

SubParsers = Any  # argparse's _SubParsersAction, which has no public name


def add_model_commands(sub: SubParsers) -> None:
    pull = sub.add_parser("pull", help="download a hub model into the Hugging Face cache",
                          description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    pull.add_argument("model", help="key or alias, or a hub repo (org/name)")
    pull.add_argument("--revision", help="branch, tag or commit (default: the model's)")
    pull.add_argument("--repair", action="store_true",
                      help="delete cached files that fail verification, then download them")
    pull.add_argument("--config", help="TOML config (default: $MODELPOOL_CONFIG)")
    pull.set_defaults(func=_pull)
    verify = sub.add_parser("verify", help="check a model's files against their hashes",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("model", help="key or alias, or a hub repo (org/name)")
    verify.add_argument("--revision", help="branch, tag or commit (default: the model's)")
    verify.add_argument("--config", help="TOML config (default: $MODELPOOL_CONFIG)")
    verify.set_defaults(func=_verify)


def find_spec(name: str, config_path: str | None, revision: str | None) -> ModelSpec:
    """The model a command names: by key or alias, else a hub repo given as org/name."""
    import msgspec

    from modelpool.supervisor.config import ConfigError, load_config

    try:
        spec = load_config(config_path).registry().resolve(name)
    except ConfigError as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    if spec is None:
        if name.count("/") != 1:
            raise PoolError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r} (give a key, an "
                            f"alias, or a hub repo as org/name)")
        spec = ModelSpec(key=name, capability="text_embedding", repo=name)
    return msgspec.structs.replace(spec, revision=revision) if revision else spec


def model_dir(spec: ModelSpec) -> Path:
    """Where the spec's files are now (a hub repo: its cached snapshot)."""
    from modelpool.registry.sources import cached_snapshot, missing_files

    if missing := missing_files(spec):
        raise PoolError(ErrorCode.MODEL_LOAD_FAILED, missing.message)
    if spec.repo:
        found = cached_snapshot(spec.repo, spec.revision)
        assert found is not None
        return found / spec.subdir
    from modelpool.registry.download import resolve_model_dir

    resolved = resolve_model_dir(spec)
    if resolved is None:
        raise PoolError(ErrorCode.BAD_REQUEST, f"model {spec.key!r} has a custom loader "
                        f"and no files to check")
    return resolved


def _verify(args: argparse.Namespace) -> int:
    from modelpool.registry.integrity import verify_dir

    spec = find_spec(args.model, args.config, args.revision)
    directory = model_dir(spec)
    report = verify_dir(directory)
    for bad in report.corrupt:
        print(f"corrupt: {bad.path}: {bad.why}")
    if report.corrupt:
        fix = f"modelpool pull {spec.key} --repair" if spec.repo else "replace the files"
        print(f"{spec.key}: {len(report.corrupt)} corrupt file(s); {fix}", file=sys.stderr)
        return EXIT_MODEL_FAILURE
    print(f"ok: {spec.key} in {directory}: {report.files} file(s), {report.checked} hashed "
          f"now, {report.remembered} unchanged since verified")
    return EXIT_OK


def _pull(args: argparse.Namespace) -> int:
    spec = find_spec(args.model, args.config, args.revision)
    if not spec.repo:
        print(f"{spec.key}: not a hub model ({spec.source}); nothing to pull")
        return _verify(args)
    if args.repair:
        _delete_corrupt(spec)
    path = download(spec)
    print(f"{spec.key}: {spec.repo}@{spec.revision} in {path}", file=sys.stderr)
    return _verify(args)


def _delete_corrupt(spec: ModelSpec) -> None:
    from modelpool.registry.integrity import blobs_of, verify_dir
    from modelpool.registry.sources import cached_snapshot

    snapshot = cached_snapshot(spec.repo or "", spec.revision)
    if snapshot is None:
        return
    corrupt = verify_dir(snapshot).corrupt
    for blob in blobs_of(corrupt):
        blob.unlink(missing_ok=True)
    for bad in corrupt:
        bad.path.unlink(missing_ok=True)  # the snapshot's link, or a plain file
        print(f"removed corrupt {bad.path} ({bad.why})", file=sys.stderr)


def download(spec: ModelSpec) -> Path:
    """huggingface_hub's snapshot download: resumable, its progress bars on a terminal."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    from modelpool.registry.download import hub_patterns

    if not on_terminal():
        disable_progress_bars()
    try:
        return Path(snapshot_download(repo_id=spec.repo or "", revision=spec.revision,
                                      allow_patterns=hub_patterns(spec)))
    except Exception as exc:  # the hub client raises many types; the cause is what matters
        raise PoolError(ErrorCode.MODEL_LOAD_FAILED, f"pulling {spec.repo}@{spec.revision} "
                        f"failed: {type(exc).__name__}: {exc}") from None
