"""Stubs generated from ``proto/hora/v1/*.proto`` by ``make proto``; never edit by hand."""
