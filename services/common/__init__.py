"""Code shared by every rlyard service: config, logging, gRPC plumbing, generated stubs, packing."""
