"""Versions of a run in a store: planning, publishing, reading, verifying, retention.

Modules (import the one you need; this package imports none of them, so
the read-only tools stay free of torch):

- :mod:`~aurora_store.lineage.plan`: which versions exist, the cheapest chain to one (pure).
- :mod:`~aurora_store.lineage.trusted`: which versions count (trusted, on the chain), never a bare listing.
- :mod:`~aurora_store.lineage.fetch`: read a version back, every object verified.
- :mod:`~aurora_store.lineage.materialize`: full weights of one version over the versions that count.
- :mod:`~aurora_store.lineage.prefetch`: fetch segments from their announcements, held until the manifest.
- :mod:`~aurora_store.lineage.publish`: write a version: segments first, manifest last.
- :mod:`~aurora_store.lineage.report`: what a run holds, one row per version.
- :mod:`~aurora_store.lineage.verify`: re-hash every object, check the chain of states.
- :mod:`~aurora_store.lineage.gc`: retention: remove orphans and unneeded versions.
- :mod:`~aurora_store.lineage.interfaces`: what lineage needs from coordination (Protocols).
"""
