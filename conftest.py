"""Repo-root conftest: puts the repo root on sys.path so `examples` imports."""
