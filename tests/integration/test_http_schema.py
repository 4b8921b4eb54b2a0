"""Schemathesis against /openapi.json: requests generated from the schema (valid and
not) never get a server error, and every answer conforms to the schema (status, content
type, body, each server-sent event). Each operation gets 12 generated requests (seed 1),
then schemathesis' stateful scenarios follow the links between operations.

Two allowances, both narrower than turning a check off:
- a 5xx is accepted only as a 504 for a request that set its own deadline or timeout
  (e.g. deadline_s = 5e-324): that is the documented answer, not a failure;
- schema-valid bodies may still be refused with a 400 that names the field (an image
  that is neither a data: nor an http(s) URL, `dimensions` of a model not made to be
  shortened): schemathesis' positive-data check is left out, the answer's shape is
  still checked.
/v1/images/generations and /v1/jobs are left out: a random size and step count can ask
the diffusion pipeline for minutes of work. test_http_openai covers them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HERE, Daemon
from http_helpers import KEY, http_daemon


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    daemon, base = http_daemon(tmp_path_factory.mktemp("http-schema"), tiny_models_dir,
                               images=True)
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


def test_schema(served: tuple[Daemon, str], tmp_path: Path) -> None:
    st = Path(sys.executable).with_name("st")
    done = subprocess.run(
        [str(st), "run", served[1] + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
         "--exclude-checks", "not_a_server_error,positive_data_acceptance",
         "--exclude-path-regex", "images|jobs", "--max-examples", "12", "--seed", "1",
         "--request-timeout", "60", "--phases", "examples,fuzzing,stateful", "--no-color"],
        cwd=tmp_path, capture_output=True, text=True, timeout=200,
        env={**os.environ, "PYTHONPATH": str(HERE), "SCHEMATHESIS_HOOKS": "st_hooks"})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    # Every operation selected was tested: with a time bound and the coverage phase (its
    # boundary cases, hundreds an operation) only 2 of 13 were, and none fuzzed.
    selected = re.search(r"Selected: (\d+)/\d+", done.stdout)
    tested = re.search(r"Tested: (\d+)", done.stdout)
    assert selected and tested and tested[1] == selected[1] and int(selected[1]) >= 13, \
        done.stdout[-3000:]
