"""hop's operators: one module each (user function, raw op, then its rules)."""
