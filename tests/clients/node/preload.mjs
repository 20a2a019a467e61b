// Loaded with NODE_OPTIONS="--import <this file>": sends Node's built-in fetch (undici) through
// HTTP(S)_PROXY. Node 20's fetch ignores those variables on its own, and its bundled undici does not
// expose EnvHttpProxyAgent to user code, hence the `undici` npm package next to this file.
import { EnvHttpProxyAgent, setGlobalDispatcher } from 'undici';

setGlobalDispatcher(new EnvHttpProxyAgent());
