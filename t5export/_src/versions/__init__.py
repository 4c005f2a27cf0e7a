"""The versions part: an export_dir's versions, their metadata and files read
back (no TF, no engine)."""
