"""The Relay: a region's mirror of a run (see :mod:`workers.relay.relay`)."""

from workers.relay.cli import add_arguments, config_from_args, main, run_from_args
from workers.relay.config import RelayConfig, RelayStats, VersionId, relay_config_from_env
from workers.relay.heartbeat import relay_key
from workers.relay.mirror import MODEL_KEYS
from workers.relay.relay import Relay, run_relay

__all__ = [
    "MODEL_KEYS",
    "Relay",
    "RelayConfig",
    "RelayStats",
    "VersionId",
    "add_arguments",
    "config_from_args",
    "main",
    "relay_config_from_env",
    "relay_key",
    "run_from_args",
    "run_relay",
]
