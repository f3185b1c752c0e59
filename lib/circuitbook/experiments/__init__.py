"""The chapters' library packages, one per chapter and all of one shape (CONTRIBUTING.md, "Adding a
chapter"): `runs` (config builders, run functions of the notebook's `cfg`, and the registry
`notebook_runs(cfg)`), `evaluate` (evaluation callbacks), `measure` (measurements with known answers) and
`records` (what the notebooks record and tabulate). `circuitbook.chapters` finds them; no chapter package
imports another's."""
