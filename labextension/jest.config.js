// Unit tests of the panel's pure logic (src/model.ts), which imports nothing from
// JupyterLab: ts-jest compiles it as CommonJS, so no babel or ESM set-up is needed.
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/src'],
  testRegex: '/__tests__/.*\\.spec\\.ts$',
  transform: {
    '^.+\\.ts$': ['ts-jest', { tsconfig: { module: 'commonjs', types: ['jest'], strict: true } }]
  }
};
