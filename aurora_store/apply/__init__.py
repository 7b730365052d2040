"""Applying staged versions to weights.

- :mod:`~aurora_store.apply.sink`: validate-then-write weight sinks;
- :mod:`~aurora_store.apply.tp`: tensor-parallel shard maps;
- prepared activation, everything but the final write done while generating:
  :mod:`~aurora_store.apply.prepared_delta` (the prepared records and
  layouts), :mod:`~aurora_store.apply.prepare` (preparing),
  :mod:`~aurora_store.apply.write_kernel` (the write) and
  :mod:`~aurora_store.apply.predict` (the digest).

Prepared activation: a :class:`~aurora_store.format.checkpoint.StagedDelta` is decoded and
validated, but applying it still checks every entry, splits fused entries
into their source tensors, searches block boundaries and makes values
writable, all at the safe point. :func:`~aurora_store.apply.prepare.prepare_delta` does that work ahead
of time, off the critical path (the Actor's stager thread), against the
layout of the weights it will land in:

- every entry is checked against the holder's parameters (name, shape,
  dtype, range, index bounds, value count and width);
- fused entries are split into their source tensors (q/k/v, gate/up);
- the writes of each source tensor are grouped by mode (overwrite or XOR)
  and concatenated in index order into one array of indices (int32 where
  the tensor allows: half the index traffic) and one of values, and the
  concatenation is checked strictly increasing: no element is written
  twice, and one look at the first and the last index bounds them all;
- values are owned, contiguous, unsigned copies (a segment's bytes are
  read-only).

:meth:`~aurora_store.apply.prepared_delta.PreparedDelta.write` is then the safe point's whole job: it checks
that every target tensor is still there with the same size, width and
device (nothing written until all are), and runs one compiled pass per
(tensor, mode) over sorted indices: consecutive writes fall in the same or
the next cache lines, so the pass costs about the memory traffic of the
lines it touches. After preparation nothing can fail halfway: a delta is
written whole or not at all.

:func:`~aurora_store.apply.predict.predicted_digest` gives the ``weights_digest`` the weights will have
once a prepared delta is written, computed while they still hold the base
(reading them through small scratch buffers, writing nothing), so an engine
can report its digest right after the safe point instead of hashing every
weight there.
"""
