"""One-line exact resume inside the frameworks people train with (docs/INTEGRATIONS.md).

``ripresa.integrations.lightning`` (Lightning's ``Trainer``) and
``ripresa.integrations.transformers`` (Hugging Face's ``Trainer``, and the
``accelerate`` glue) each hold the framework's glue; they import the framework,
so this package imports nothing by itself and the rest of ripresa imports
without any framework installed. The loader mechanism they share,
``ripresa.make_exact``, lives in ``ripresa.core.loader``.
"""
