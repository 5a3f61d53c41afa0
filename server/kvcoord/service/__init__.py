"""kvcoord's server side: gRPC servicer, pool registry, metrics and the CLI."""
