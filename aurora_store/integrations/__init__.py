"""Aurora inside other people's training loops (docs/INTEGRATIONS.md).

One module per framework, each imported only by its users (it may pull in
the framework at import): :mod:`aurora_store.integrations.trl` is a
``transformers.TrainerCallback`` that publishes every optimizer step of a
Hugging Face ``Trainer`` or TRL trainer (``GRPOTrainer`` …). Nothing else
in ``aurora_store`` imports this package.
"""
