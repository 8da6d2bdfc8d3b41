# Flags shared by every target of ours (never by imported ones).
function(fsdp_target_defaults target)
  # Designated initializers leave members at their defaults on purpose.
  # -fPIC everywhere (not -fPIE for executables) so that one LibTorch precompiled header
  # serves libraries and executables alike.
  target_compile_options(${target} PRIVATE -fPIC -Wall -Wextra -Wpedantic -Wno-missing-field-initializers)
  if(FSDP_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  if(FSDP_UNITY)
    # In a batch, a source's anonymous namespace is no longer its main file's: GCC's warning
    # about types from it in members of named types would fire where nothing leaks.
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${FSDP_UNITY_BATCH})
    target_compile_options(${target} PRIVATE -Wno-subobject-linkage)
  endif()
  if(FSDP_TARGET_ROLE STREQUAL "test")
    # A test program (tests/ sets FSDP_TARGET_ROLE) compiles its own code at -O0 -g1, in every
    # build: the code under test, our libraries and tools, keeps the build's flags. Under
    # FSDP_SANITIZE the test is not instrumented either and links the sanitizers' runtime for
    # the code under test. unit_fsdp's batch: 17 s against 48 s instrumented at -O1 (half of the
    # sanitizer build was the tests' own code), 21 s against 28 s at -O2 in the plain build.
    # What is lost under the sanitizers: checks inside the tests' own code, and in inline code of
    # our headers where the linker keeps a test's copy of it.
    target_compile_options(${target} PRIVATE -O0 -g1)
    if(FSDP_SANITIZE)
      target_link_options(${target} PRIVATE -fsanitize=address,undefined)
    endif()
  elseif(FSDP_SANITIZE)
    # The sanitizers' instrumentation makes GCC 12 report maybe-uninitialized inside libstdc++
    # (std::regex, std::function) where nothing is; the plain build keeps the warning.
    # -O1 -g1 after the build type's -O2 -g: what the sanitizers' reports need (line tables and
    # function names; ASan's own advice is -O1) at about 60% of the compile time of -O2 -g, which
    # is most of CI's second build (worker/src/checkpoint/snapshot/snapshot.cpp: 48 s against 78 s).
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                                             -fno-sanitize-recover=undefined -Wno-maybe-uninitialized
                                             -O1 -g1)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  elseif(NOT FSDP_FULL_DEBUG_INFO)
    # -g1 after RelWithDebInfo's -g: line tables and function names, all that the hang reports'
    # stacks, gdb's backtraces and a crash's trace read, at about 60% of the compile time of -g
    # for one file alone (worker's first unity batch: 25 s against 43 s; its precompiled header
    # 29 s against 55 s) and 76% for a whole fresh build (745 s against 980 s).
    target_compile_options(${target} PRIVATE $<$<CONFIG:RelWithDebInfo>:-g1>)
  endif()
endfunction()

# A library of one part: public headers under <part>/include, sources under <part>/src.
function(fsdp_library target)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${target} ${ARG_SOURCES})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  fsdp_target_defaults(${target})
endfunction()

function(fsdp_executable target)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${target} ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE ${ARG_DEPS})
  fsdp_target_defaults(${target})
endfunction()
