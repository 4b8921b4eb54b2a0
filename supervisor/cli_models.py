"""`modelpool pull MODEL` and `modelpool verify MODEL`: a model's files, without the daemon.

pull downloads a hub model into the Hugging Face cache with huggingface_hub (its own
progress bar, on a terminal only; an interrupted pull resumes where it stopped), then
verifies what it has; `--repair` first deletes every cached file that fails its check,
so that the download replaces it. verify runs the checks a load runs on the files it
would use (registry/integrity.py).
MODEL is a key or alias of the catalogue and the config (`--config`, else
$MODELPOOL_CONFIG), or any hub repo as org/name.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.registry.model_files import delete_corrupt, download, model_dir
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.cli_common import EXIT_MODEL_FAILURE, EXIT_OK

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
        for path, why in delete_corrupt(spec):
            print(f"removed corrupt {path} ({why})", file=sys.stderr)
    path = download(spec)
    print(f"{spec.key}: {spec.repo}@{spec.revision} in {path}", file=sys.stderr)
    return _verify(args)
