# One copy of Gloo per process: whether libfsdp links a Gloo of its own.
#
# Debian's LibTorch links Debian's libgloo.so.0 (one shared copy: ours and c10d's are the same).
# PyTorch's wheels link Gloo statically into libtorch_cpu.so and export its symbols; a second
# Gloo beside it (Debian's, or one built from source) would put two definitions of every gloo::
# symbol into one process, and the dynamic linker would mix them. So:
#   FSDP_GLOO=AUTO (default): Gloo when this LibTorch defines no gloo:: symbol of its own; else
#                             none: cpuComm() is the shared-memory communicator inside a node,
#                             and CPU collectives across nodes are refused with a named reason.
#   FSDP_GLOO=ON:  Gloo required; a LibTorch that has its own copy is a configuration error.
#   FSDP_GLOO=OFF: no Gloo.
# Sets FSDP_HAVE_GLOO (0/1) and FSDP_GLOO_REASON (why not, for messages at run time).
set(FSDP_GLOO AUTO CACHE STRING "Link Gloo for CPU collectives: AUTO, ON or OFF")
set_property(CACHE FSDP_GLOO PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${FSDP_GLOO}" _fsdp_gloo)
if(NOT _fsdp_gloo MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "fsdp: FSDP_GLOO='${FSDP_GLOO}': expected AUTO, ON or OFF")
endif()

# Does this LibTorch define gloo:: symbols (functions, vtables, typeinfo in namespace gloo)?
# Symbols that merely mention gloo in their arguments (c10d::ProcessGroupGloo's) do not count.
find_library(FSDP_TORCH_CPU_LIBRARY torch_cpu HINTS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH)
if(NOT FSDP_TORCH_CPU_LIBRARY)
  find_library(FSDP_TORCH_CPU_LIBRARY torch_cpu)
endif()
find_program(FSDP_NM nm)
set(FSDP_TORCH_GLOO_SYMBOLS 0)
if(FSDP_TORCH_CPU_LIBRARY AND FSDP_NM)
  execute_process(COMMAND ${FSDP_NM} -D --defined-only ${FSDP_TORCH_CPU_LIBRARY}
                  OUTPUT_VARIABLE _fsdp_symbols ERROR_QUIET RESULT_VARIABLE _fsdp_nm_status)
  if(_fsdp_nm_status EQUAL 0)
    string(REGEX MATCHALL " _Z(T[VIS])?NK?4gloo[^\n]*" _fsdp_gloo_defs "${_fsdp_symbols}")
    list(LENGTH _fsdp_gloo_defs FSDP_TORCH_GLOO_SYMBOLS)
  endif()
  unset(_fsdp_symbols)
else()
  message(WARNING "fsdp: cannot tell whether LibTorch has its own Gloo (torch_cpu=${FSDP_TORCH_CPU_LIBRARY}, "
                  "nm=${FSDP_NM}); assuming it has none")
endif()

set(FSDP_GLOO_REASON "")
if(_fsdp_gloo STREQUAL "OFF")
  set(FSDP_GLOO_REASON "configured with FSDP_GLOO=OFF")
elseif(FSDP_TORCH_GLOO_SYMBOLS GREATER 0)
  set(FSDP_GLOO_REASON "LibTorch (${FSDP_TORCH_CPU_LIBRARY}) has its own Gloo (${FSDP_TORCH_GLOO_SYMBOLS} gloo:: symbols): a second copy would mix with it")
  if(_fsdp_gloo STREQUAL "ON")
    message(FATAL_ERROR "fsdp: FSDP_GLOO=ON but ${FSDP_GLOO_REASON}. Configure with FSDP_GLOO=AUTO "
                        "(shared memory for CPU collectives inside a node).")
  endif()
endif()

if(FSDP_GLOO_REASON STREQUAL "")
  find_package(Gloo REQUIRED)
  set(FSDP_HAVE_GLOO 1)
  message(STATUS "fsdp: Gloo communicator enabled (LibTorch defines no gloo:: symbol of its own)")
else()
  set(FSDP_HAVE_GLOO 0)
  message(STATUS "fsdp: Gloo communicator left out: ${FSDP_GLOO_REASON}")
endif()
