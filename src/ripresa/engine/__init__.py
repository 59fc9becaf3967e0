"""The ANDREA application: GPT engine, mixture, pivot, fork, ledger, plots, demo."""
