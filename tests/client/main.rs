//! The client's outbox and retry helper, and the edge client across SIGKILLs: one test binary,
//! a module per former test file.

mod client;
mod edge_client_crash;
