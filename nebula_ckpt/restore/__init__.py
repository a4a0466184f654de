"""Internal: the restore path: select the step, open it, apply it in place; adopt and reshard."""
