"""Applying staged versions: validate-then-write weight sinks (:mod:`~aurora_store.apply.sink`)
and tensor-parallel shard maps (:mod:`~aurora_store.apply.tp`)."""
