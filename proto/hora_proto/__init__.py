"""hora's contract: what the trainer library and the coordinator both rely on.

``hora_proto.v1`` holds the gRPC stubs generated from ``proto/hora/v1``. The
small modules beside it are pure policy that both sides must compute the
same way: how the job token travels (:mod:`.auth`), how ranks are placed on
hosts (:mod:`.placement`) and how tensors are sized and grouped for fusion
(:mod:`.tensors`). This package imports neither ``hora`` nor
``hora_coordinator``; both import it.
"""
