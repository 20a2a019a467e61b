// Loaded with NODE_OPTIONS="--import ./preload.mjs" (run.yaml sets it): sends Node's built-in fetch,
// which the openai package uses, through HTTP(S)_PROXY. Node 20's fetch ignores those variables on its
// own, and its bundled undici does not expose EnvHttpProxyAgent, hence the `undici` package here.
import { EnvHttpProxyAgent, setGlobalDispatcher } from 'undici';

setGlobalDispatcher(new EnvHttpProxyAgent());
