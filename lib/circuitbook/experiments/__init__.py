"""The chapters' library packages, one per chapter and all of one shape (CONTRIBUTING.md, "Adding a
chapter"): `runs` (config builders, run functions of the notebook's `cfg`, and the registry
`notebook_runs(cfg)`), `evaluate` (evaluation callbacks), `measure` (measurements with known answers) and
`records` (what the notebooks record and tabulate). `circuitbook.chapters` finds them; no chapter package
imports another's."""

import inspect as _inspect


def public_names(namespace: dict, *modules) -> list[str]:
    """Re-export into a chapter package's `namespace` what its modules define: every public function and
    class defined in one of `modules`, and every public UPPER_CASE constant they hold; returns the names
    (the package's `__all__`). So a notebook reads `xx.name` whatever module defines it, and a new function
    is exported without a list to keep in step."""
    names = []
    for module in modules:
        for name, obj in vars(module).items():
            if name.startswith("_") or _inspect.ismodule(obj):
                continue
            if getattr(obj, "__module__", None) == module.__name__ or (name.isupper() and not callable(obj)):
                namespace[name] = obj
                names.append(name)
    return sorted(set(names))
