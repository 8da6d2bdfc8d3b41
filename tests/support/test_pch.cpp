// Empty: the target that builds the tests' precompiled header under FSDP_SANITIZE
// (tests/CMakeLists.txt) needs a source to compile it with.
