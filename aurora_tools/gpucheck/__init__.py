"""``make gpu-check``: the GPU path run for real on one accelerator, in one JSON line.

Run with ``python3 -m aurora_tools.gpucheck`` on a machine that has its own
Python and a CUDA build of torch but not this project's virtual environment.
``make gpu-check`` first asks :mod:`.preflight` (stdlib and torch only)
whether there is a GPU to check at all: if not, it prints
``{"gpu": false, "reason": "…"}`` and exits 0 at once. Otherwise it fetches
the wheels of ``aurora_tools/gpucheck/requirements.txt`` when they are not
there yet (``make gpu-wheels``, from the package registries), installs
those the machine lacks (:mod:`.install`) and runs the check with the
project on ``PYTHONPATH``.

- :mod:`.weights8b`: an 8B-shaped bf16 model (Llama-3-8B shapes) allocated
  on the device; extraction of a ~1% delta there (:func:`aurora_store.codec.extract.extract`
  over the Trainer's fusion plan), the device's copy bandwidth beside it,
  zstd encoding on the CPU apart, the apply of that delta into the weights
  on the device (:func:`aurora_store.apply.sink.apply_delta` into
  :class:`~aurora_store.apply.sink.SplitWeights`, as the torch engine does)
  and the tree digest of the weights there (what an Actor verifies);
- :mod:`.e2e`: the real ``aurora trainer --device cuda`` (through
  :mod:`.trainer_child`, which reads its peak device memory) and a real
  ``aurora actor --engine vllm`` for a few steps through the testbed's Redis
  and S3 server, on a small Qwen3 built on the spot; the Actor's weights
  must hash to the Trainer's digest at every version it verifies;
- :mod:`.main`: the command line and the JSON report; ``--device cpu
  --small`` runs the same code on the CPU with the torch engine
  (``tests/test_gpucheck.py``).
"""
