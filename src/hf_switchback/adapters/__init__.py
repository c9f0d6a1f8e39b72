"""The few places where hf_switchback reaches into another library's private state, one module per library.

Each accessor names the versions it was checked against, says why the public API does not suffice, and raises
a clear error (or takes a documented fallback) when the private attribute is gone, so a new release of that
library fails loudly here instead of breaking training silently. Leaves: they import nothing from the package.
"""
