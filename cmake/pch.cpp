// The translation unit that builds the shared precompiled header (see CMakeLists.txt).
