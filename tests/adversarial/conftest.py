"""The adversarial suite runs real daemons with the integration suite's helpers and
fixtures (tests/integration/conftest.py), loaded here under a name of their own so that
`from conftest import ...` in this folder finds them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
_spec = importlib.util.spec_from_file_location("_modelpool_integration_conftest", _PATH)
assert _spec is not None and _spec.loader is not None
_integration = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _integration
_spec.loader.exec_module(_integration)

OTHER_GID = _integration.OTHER_GID
OTHER_UID = _integration.OTHER_UID
ROOT = _integration.ROOT
as_other_user = _integration.as_other_user
other_user_env = _integration.other_user_env
Daemon = _integration.Daemon
daemon_env = _integration.daemon_env
fresh_socket_path = _integration.fresh_socket_path
model_entry = _integration.model_entry
start_daemon = _integration.start_daemon
wait_for_socket = _integration.wait_for_socket
make_daemon = _integration.make_daemon  # fixtures
tiny_llm_dir = _integration.tiny_llm_dir
