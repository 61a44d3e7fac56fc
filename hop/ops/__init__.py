"""hop's operators, by family: ``branching`` (cond, switch), ``scanning`` (scan, map,
associative_scan) and ``while_loops`` (while_loop, fori_loop, bounded_while). Each
operator is one module (user function, raw op, then its rules); what a family's
operators share is a private module of its folder, and what every family shares is
``_common`` (and ``_lean_body``, the eager runner of traced loop bodies)."""
