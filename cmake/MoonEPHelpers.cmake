# Compile flags shared by every project target; third-party code never sees -Werror.
add_library(moonep_warnings INTERFACE)
target_compile_options(moonep_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX,C>:-Wall -Wextra -Werror>)

if(MOONEP_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(MOONEP_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT MOONEP_SANITIZE STREQUAL "")
  message(FATAL_ERROR "MOONEP_SANITIZE must be '', 'address' or 'thread'")
endif()

# moonep_library(name SOURCES ... DEPS ...): a static, position-independent part of the runtime.
function(moonep_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PUBLIC_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/moonep/include>)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE moonep_warnings ${ARG_DEPS})
  set_target_properties(${name} PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
endfunction()

# moonep_executable(name SOURCES ... DEPS ...): a program in build/bin.
function(moonep_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE moonep_warnings ${ARG_DEPS})
endfunction()
