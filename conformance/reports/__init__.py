"""Reports of a run: text, JSON, JUnit XML, the replay script of a failure, and the files
they are written to (checked and marked incomplete before the run, replaced atomically)."""
