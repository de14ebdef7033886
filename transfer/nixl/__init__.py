"""NIXL as a transport of KV pages (the ``lanekv[nixl]`` extra): the rank's side
(``export``), its staging region of head ranges (``staging``), the agent both sides run
(``agent``) and the runs of pages a read moves (``runs``). gRPC stays the control plane."""
