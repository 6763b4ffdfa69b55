"""moescope's shared vocabulary, below every other package: routing traces (`core.trace`, imported logs in
`core.trace_import`, statistics in `core.routing_stats`), telemetry (`core.telemetry`), config helpers
(`core.config`) and the shipped text sources (`core.texts`, `core.sharegpt`, `core.stdlib_texts`).
It imports no other moescope package (checked by import-linter, see pyproject.toml)."""
