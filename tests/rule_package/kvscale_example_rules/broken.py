"""Fails at import on purpose: kvscale must report it once and keep working."""

raise RuntimeError("kvscale_example_rules.broken: this rule package is broken on purpose")
