# Apple only (included under if(APPLE)): the ahead-of-time fused_adam.metallib and the `_metal`
# extension, both installed into mps_fused_adam/ side by side. Nothing of torch is needed here:
# `_metal` looks torch::mps::* up at run time in the libtorch `import torch` loaded.
# Untested on Apple hardware until the release pipeline's Apple Silicon job has run.
enable_language(OBJCXX)

# bfloat needs Metal 3.1 (macOS 14), PyTorch's MPS minimum. (The extension's own deployment
# target comes from CMAKE_OSX_DEPLOYMENT_TARGET / MACOSX_DEPLOYMENT_TARGET, set before project().)
set(MFA_MACOS_MIN 14.0)

# Run the compiler: without Xcode 26's separate Metal toolchain, `xcrun -f metal` still finds a
# stub that only prints "cannot execute tool 'metal' due to missing Metal Toolchain".
execute_process(COMMAND xcrun -sdk macosx metal --version RESULT_VARIABLE MFA_METAL_RC
                OUTPUT_VARIABLE MFA_METAL_OUT ERROR_VARIABLE MFA_METAL_OUT)
if(NOT MFA_METAL_RC EQUAL 0 OR MFA_METAL_OUT MATCHES "missing Metal Toolchain")
  message(FATAL_ERROR "The Metal compiler does not run (Xcode 26 ships it separately: "
                      "xcodebuild -downloadComponent MetalToolchain): ${MFA_METAL_OUT}")
endif()

# Fast math off, as MLX and PyTorch build their kernels; in the MSL specification that mode
# ("safe") still contracts a * b + c into fma, so contraction is switched off explicitly.
set(MFA_METAL_FLAGS -std=metal3.1 -mmacosx-version-min=${MFA_MACOS_MIN} -fno-fast-math
                    -ffp-contract=off -Wall -Wextra)

file(GLOB MFA_METAL_SOURCES CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/metal/*.metal")
set(MFA_AIR_FILES "")
foreach(src ${MFA_METAL_SOURCES})
  get_filename_component(stem "${src}" NAME_WE)
  set(air "${CMAKE_CURRENT_BINARY_DIR}/${stem}.air")
  add_custom_command(
    OUTPUT "${air}"
    COMMAND xcrun -sdk macosx metal ${MFA_METAL_FLAGS} -c "${src}" -o "${air}"
    DEPENDS "${src}"
    COMMENT "Compiling ${stem}.metal to AIR"
    VERBATIM)
  list(APPEND MFA_AIR_FILES "${air}")
endforeach()

set(MFA_METALLIB "${CMAKE_CURRENT_BINARY_DIR}/fused_adam.metallib")
add_custom_command(
  OUTPUT "${MFA_METALLIB}"
  COMMAND xcrun -sdk macosx metallib ${MFA_AIR_FILES} -o "${MFA_METALLIB}"
  DEPENDS ${MFA_AIR_FILES}
  COMMENT "Linking fused_adam.metallib"
  VERBATIM)
add_custom_target(mfa_metallib ALL DEPENDS "${MFA_METALLIB}")
install(FILES "${MFA_METALLIB}" DESTINATION mps_fused_adam)

nanobind_add_module(_metal NB_STATIC src/metal/metal_adam.mm)
add_dependencies(_metal mfa_metallib)
target_compile_options(_metal PRIVATE -fobjc-arc)
find_library(MFA_METAL_FRAMEWORK Metal REQUIRED)
find_library(MFA_FOUNDATION_FRAMEWORK Foundation REQUIRED)
target_link_libraries(_metal PRIVATE ${MFA_METAL_FRAMEWORK} ${MFA_FOUNDATION_FRAMEWORK})
install(TARGETS _metal LIBRARY DESTINATION mps_fused_adam)
