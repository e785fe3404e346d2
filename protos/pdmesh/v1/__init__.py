"""Python stubs generated from the .proto files beside them (`make protos`); do not edit."""
