"""The public optimizer classes and their shared step path: validation, step plans, the step entry."""
