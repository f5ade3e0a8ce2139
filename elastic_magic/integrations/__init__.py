"""What makes the trainers people use elastic the way a ``State`` loop is: one line each
(``integrations.lightning`` for PyTorch Lightning, ``integrations.transformers`` for
HuggingFace's ``Trainer``). They run inside the ranks, beside the training API."""
