# memplan_forbid_links(<target> <forbidden>...): fails the configure when <target> links any of
# <forbidden>, directly or through any library it links (LINK_LIBRARIES and
# INTERFACE_LINK_LIBRARIES, followed to the bottom; $<BUILD_INTERFACE:..>, $<LINK_ONLY:..> and the
# like are looked through, aliases resolved). Called once every module's target exists (the
# top-level CMakeLists.txt), so that a link added anywhere below <target> is seen too.
function(memplan_forbid_links target)
  set(forbidden ${ARGN})
  set(seen "")
  set(queue ${target})
  # The chain that reached each target, for the message: "memplan_planner -> ... -> memplan_nvme".
  set(_path_${target} ${target})
  while(queue)
    list(POP_FRONT queue current)
    get_target_property(imported ${current} IMPORTED)
    if(imported)
      continue()  # a system library (nlohmann_json, Eigen): never one of ours
    endif()
    set(links "")
    foreach(property LINK_LIBRARIES INTERFACE_LINK_LIBRARIES)
      get_target_property(value ${current} ${property})
      if(value)
        list(APPEND links ${value})
      endif()
    endforeach()
    foreach(link IN LISTS links)
      # Keep what a generator expression would name: drop "$<NAME:" openers and ">" closers. The
      # condition part of "$<$<BOOL:x>:lib>" leaves harmless non-target words behind.
      string(REGEX REPLACE "\\$<[A-Za-z_]+:" "" link "${link}")
      string(REPLACE ">" "" link "${link}")
      string(REPLACE "," ";" parts "${link}")
      foreach(name IN LISTS parts)
        if(NOT TARGET "${name}")
          continue()
        endif()
        get_target_property(aliased ${name} ALIASED_TARGET)
        if(aliased)
          set(name ${aliased})
        endif()
        if(name IN_LIST seen)
          continue()
        endif()
        list(APPEND seen ${name})
        set(_path_${name} "${_path_${current}} -> ${name}")
        if(name IN_LIST forbidden)
          message(FATAL_ERROR "${target} must not link ${name}, and does: ${_path_${name}}. "
            "See Note [Schedule contract] in schedule/schedule.h and the layers in "
            "docs/architecture.md: what the planner needs of the engine is the Schedule, in "
            "memplan_schedule.")
        endif()
        list(APPEND queue ${name})
      endforeach()
    endforeach()
  endwhile()
endfunction()
