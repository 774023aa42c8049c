"""What was read and what to read first: the access recorder, the entries a trace names (resolve, the
newest coherent checkpoint), the replay of a trace, and the request window shared with materialization."""
