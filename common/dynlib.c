/* Shared libraries loaded on first use (see dynlib.h). */
#include "dynlib.h"

#include <dlfcn.h>
#include <stdio.h>

bool moe_dynlib_load(const char *soname, const char *dir, const struct moe_dynlib_sym *syms,
                     size_t n, char *why, size_t why_size)
{
    void *lib = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!lib && dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, soname);
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (!lib) {
        snprintf(why, why_size, "cannot load %s: %s", soname, dlerror());
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!(*syms[i].slot = dlsym(lib, syms[i].name))) {
            snprintf(why, why_size, "%s has no %s", soname, syms[i].name);
            return false;
        }
    }
    return true;
}
