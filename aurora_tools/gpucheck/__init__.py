"""``make gpu-check``: the GPU path measured on one accelerator, in one JSON object.

Run with ``python3 -m aurora_tools.gpucheck`` on a machine that has its own
Python and a CUDA build of torch but not this project's virtual environment:
``make gpu-check`` first installs the wheels of
``aurora_tools/gpucheck/requirements.txt`` that the machine lacks
(:mod:`.install`, from ``make gpu-wheels``, no network), then runs it with
the project on ``PYTHONPATH``. It needs no server: the store is ``file://``
in a temporary folder, and Redis is not involved.

- :mod:`.weights8b`: an 8B-shaped bf16 model (Llama-3-8B shapes) allocated
  on the device; extraction of a ~1% delta there (:func:`aurora_store.codec.extract.extract`
  over the Trainer's fusion plan), the device's copy bandwidth beside it,
  zstd encoding on the CPU apart, and the apply of that delta into the
  weights on the device (:func:`aurora_store.apply.sink.apply_delta` into
  :class:`~aurora_store.apply.sink.SplitWeights`, as the torch engine does);
- :mod:`.grpo`: two GRPO steps of a tiny Qwen3 with the torch engine on the
  device, each published as a delta, fetched and applied into the engine,
  whose weights digest must equal the Trainer's;
- :mod:`.main`: the command line and the JSON report; ``--device cpu
  --small`` is what CI runs (``tests/test_gpucheck.py``).
"""
