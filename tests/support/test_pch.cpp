// Empty: the target that builds the tests' precompiled header
// (tests/CMakeLists.txt) needs a source to compile it with.
