"""The numeric contract of every update rule (host scalars, element math) and its plain-torch references."""
