"""The decode daemon's prefix cache (``cache``) and what it knows of its prefill daemons' (``route``)."""
