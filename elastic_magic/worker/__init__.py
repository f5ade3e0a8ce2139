"""The worker side: ``python -m elastic_magic.worker`` and the code it runs."""
