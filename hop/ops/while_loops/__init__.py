"""while_loop and the loops built on it: fori_loop (a counted while_loop, no raw op of
its own) and bounded_while (declared by its decomposition, as a user's operator is)."""
