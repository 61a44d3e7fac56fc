"""cond and switch: cond is a two-branch switch, and both are registrations of one set
of rules (``_rules``) written against a record (``_record``)."""
