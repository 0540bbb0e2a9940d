# Finds LibTorch and defines troupe_torch, the one target the rest of the build links for it.
# The PyPI wheel is built against CUDA; its CMake package insists on a matching toolkit.
# When nvcc is missing or its major version differs from the wheel's, we link the CPU
# libraries directly so the build still succeeds (CUDA kernels off) and say so.
set(TROUPE_TORCH_ROOT "" CACHE PATH "the torch package folder inside the virtual environment")
set(TROUPE_TORCH_CUDA_VERSION "" CACHE STRING "CUDA version the torch wheel was built with")
if(NOT EXISTS "${TROUPE_TORCH_ROOT}/include/torch")
  message(FATAL_ERROR "TROUPE_TORCH_ROOT='${TROUPE_TORCH_ROOT}' holds no LibTorch: run 'make' (it runs scripts/setup.sh)")
endif()
list(APPEND CMAKE_PREFIX_PATH "${TROUPE_TORCH_ROOT}/share/cmake")
find_package(CUDAToolkit QUIET)
set(_troupe_use_torch_cuda OFF)
set(TROUPE_WITH_CUDA OFF)
if(CUDAToolkit_FOUND AND TROUPE_TORCH_CUDA_VERSION)
  string(REGEX MATCH "^[0-9]+" _wheel_major "${TROUPE_TORCH_CUDA_VERSION}")
  if(CUDAToolkit_VERSION_MAJOR STREQUAL _wheel_major)
    set(_troupe_use_torch_cuda ON)
  endif()
endif()

add_library(troupe_torch INTERFACE)
# libtorch.so exports its own copies of some std::filesystem functions (remove_all among
# them) that crash when called from our code; naming libstdc++ first makes the dynamic
# linker bind those symbols to the system library.
target_link_libraries(troupe_torch INTERFACE -Wl,--push-state,--no-as-needed stdc++ -Wl,--pop-state)
if(_troupe_use_torch_cuda)
  # A fixed arch list skips torch's GPU probe (a try_run that fails on machines without one).
  if(NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  find_package(Torch REQUIRED)
  set(TROUPE_WITH_CUDA ON)
  get_filename_component(_site "${TROUPE_TORCH_ROOT}" DIRECTORY)
  set(TROUPE_NCCL_INCLUDE_DIR "${_site}/nvidia/nccl/include")
  if(NOT EXISTS "${TROUPE_NCCL_INCLUDE_DIR}/nccl.h")
    message(FATAL_ERROR "troupe: the torch wheel's NCCL headers are not at ${TROUPE_NCCL_INCLUDE_DIR}")
  endif()
  target_link_libraries(troupe_torch INTERFACE ${TORCH_LIBRARIES})
  target_compile_options(troupe_torch INTERFACE ${TORCH_CXX_FLAGS})
  message(STATUS "troupe: LibTorch ${Torch_VERSION} with CUDA ${TROUPE_TORCH_CUDA_VERSION} (toolkit ${CUDAToolkit_VERSION})")
else()
  set(_torch_root "${TROUPE_TORCH_ROOT}")
  set(TORCH_INCLUDE_DIR "${_torch_root}/include")
  find_library(TORCH_CPU_LIB torch_cpu PATHS "${_torch_root}/lib" NO_DEFAULT_PATH REQUIRED)
  find_library(TORCH_LIB torch PATHS "${_torch_root}/lib" NO_DEFAULT_PATH REQUIRED)
  find_library(C10_LIB c10 PATHS "${_torch_root}/lib" NO_DEFAULT_PATH REQUIRED)
  target_include_directories(troupe_torch SYSTEM INTERFACE
    "${TORCH_INCLUDE_DIR}" "${TORCH_INCLUDE_DIR}/torch/csrc/api/include")
  target_link_libraries(troupe_torch INTERFACE ${TORCH_LIB} ${TORCH_CPU_LIB} ${C10_LIB})
  # c10d's headers hide Gloo's process group behind these, as the wheel's own CMake package
  # would define them (NCCL's only in CUDA builds).
  target_compile_definitions(troupe_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1 USE_DISTRIBUTED USE_C10D_GLOO)
  message(WARNING "troupe: CUDA toolkit missing or not CUDA ${TROUPE_TORCH_CUDA_VERSION}: "
                  "building the CPU path only (CUDA kernels off)")
endif()
