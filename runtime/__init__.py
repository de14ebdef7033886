"""Infrastructure both daemons share, below them: the daemon skeleton, security, metrics,
request parsing, status mapping, host memory. Nothing here imports prefill/ or decode/."""
