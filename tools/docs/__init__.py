"""The docs site builder (`make docs`, `python tools/docs/build.py`): see tools/docs/README.md."""
