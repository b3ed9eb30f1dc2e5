"""Reports of a run: text, JSON, JUnit XML, and the replay script of a failure."""
