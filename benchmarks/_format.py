"""Number formatting shared by the benchmark tables."""


def fmt(v) -> str:
    """A figure with as many digits as its size deserves; "-" for a missing one."""
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"
